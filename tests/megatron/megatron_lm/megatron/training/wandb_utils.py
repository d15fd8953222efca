# Megatron-LM's wandb hook (megatron/training/wandb_utils.py, core_v0.16.1):
# without a wandb writer (no --wandb-project) it does nothing.


def on_save_checkpoint_success(checkpoint_path, tracker_filename, save_dir, iteration):
    pass
