"""(see module docstrings)"""
