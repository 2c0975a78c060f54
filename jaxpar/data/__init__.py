"""Data: batch layouts and sources that read only this host's rows."""
