"""The package version, in a leaf module so that any layer (checkpoint manifests) can record it."""

__version__ = "0.1.0"
