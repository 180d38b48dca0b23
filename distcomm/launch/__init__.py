"""distcomm-run, the elastic launcher; filled in by its own work."""
