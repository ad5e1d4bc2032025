"""Cross-rank checks: the collective fingerprint, how a flat group's collectives carry it, and one error
on every rank. Imports ``engine.base`` only (nothing of ``engine.core`` or ``engine.surface``)."""
