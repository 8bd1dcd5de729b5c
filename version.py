"""The package version (one place: `phalanx --version`, `GET /version`, the package)."""

__version__ = "0.1.0"
