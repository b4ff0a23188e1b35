"""The OpenAI-compatible HTTP front of epdmesh."""
