"""Files that survive a crash: atomic writes and append-only JSONL (atomic.py). Imports nothing of fsdptrain."""
