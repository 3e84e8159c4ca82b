"""Scripts the tests run in subprocesses (several virtual devices, several hosts), each
printing one JSON document; run with tests/ on PYTHONPATH."""
