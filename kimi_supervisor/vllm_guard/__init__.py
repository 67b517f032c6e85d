"""The guard vLLM imports (`--middleware kimi_profile_guard.ProfileGuard`): this folder is put on
vLLM's PYTHONPATH by the launcher, so it holds that one stdlib-only module and nothing else."""
