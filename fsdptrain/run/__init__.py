"""What every recipe's run uses and no recipe owns: the run directory and who owns it, the checkpointer, the files a
run writes, the console, the experiment trackers and the stop signals (docs/architecture.md)."""
