"""The ground the step stands on: the layout (plan, strategy), the device and backend, dtypes, offload
settings, the torch.distributed calls (collectives, the watchdog behind their waits), streams and the
environment flags. Imports nothing of ``engine.checks``, ``engine.core`` or ``engine.surface``."""
