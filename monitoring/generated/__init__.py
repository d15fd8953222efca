"""Modules generated from proto/ by grpcio-tools (checked in; see tests)."""
