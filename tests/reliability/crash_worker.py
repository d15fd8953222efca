"""One rank of a crash case (run as a script by test_crash.py).

Saves a committed checkpoint ``prev``, trains one step, then saves ``cur``
(sync, eager async or lazy async) while the fault hook SIGKILLs the victim
rank at the case's point. Writes what it saw to ``<out>/rank<r>.json`` and
the expected tensors to ``<out>/expected-{prev,cur}.pt``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, mode, kill, delay_spec = sys.argv[4], sys.argv[5], sys.argv[6], sys.argv[7]

    import torch
    import torch.distributed as dist

    import bytecp
    from bytecp import recorder

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.Linear(200, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step(replicate: bool = True) -> None:
        model(torch.ones(4, 96)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if replicate:
            # the same step on every rank can still round differently (BLAS kernels depend
            # on buffer alignment), and the save checks that replicas are identical: keep
            # them identical as data parallelism would
            for t in [*model.parameters(), *(v for s in opt.state.values() for v in s.values())]:
                if isinstance(t, torch.Tensor):
                    dist.broadcast(t.data, 0)

    def snapshot() -> dict:
        return {k: v.clone() for k, v in model.state_dict().items()}

    step()
    state = {"model": model, "optim": opt}
    prev = snapshot()
    bytecp.save(f"{out}/run/step-1", state, step=1)
    step()
    cur = snapshot()
    if rank == 0:
        torch.save({"prev": prev, "cur": cur}, f"{out}/expected.pt")
    dist.barrier()

    os.environ["BYTECP_FAULT_KILL"] = kill
    if delay_spec != "-":
        os.environ["BYTECP_FAULT_DELAY"] = delay_spec
    result: dict = {"rank": rank}
    events: list[str] = []

    class Events:  # the recorders' view of the same outcome as the warnings'
        def on_report(self, report: object) -> None:
            pass

        def on_event(self, name: str, value: float, labels: dict[str, str]) -> None:
            if name == "save_committed_with_errors":
                events.append(labels.get("operation", ""))

    recorder.add_recorder(Events())
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            url = f"{out}/run/step-2"
            if mode == "sync":
                md = bytecp.save(url, state, step=2)
            else:
                h = bytecp.async_save(url, state, step=2, lazy=mode == "lazy")
                if mode == "lazy":
                    step(replicate=False)  # the pre-step hook waits for staging
                md = h.wait(timeout=60)
            result.update(ok=True, save_id=md.save_id)
        except bytecp.DistributedCheckpointError as e:
            result.update(ok=False, error=str(e))
        except Exception as e:  # anything else is a bug the test reports
            result.update(ok=False, error=f"UNEXPECTED {type(e).__name__}: {e}")
    result["seconds"] = time.perf_counter() - t0
    result["warnings"] = [str(w.message) for w in seen if issubclass(w.category, bytecp.CommittedWithErrorsWarning)]
    result["committed_with_errors"] = events
    # whole or not at all: the victim's kill may land while it writes (it finished its save first)
    with open(f"{out}/rank{rank}.json.tmp", "w") as f:
        json.dump(result, f)
    os.replace(f"{out}/rank{rank}.json.tmp", f"{out}/rank{rank}.json")
    os._exit(0)  # never wait on a broken group at exit


if __name__ == "__main__":
    main()
