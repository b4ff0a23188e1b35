"""A discrete-event simulator of an epdmesh mesh that runs the live code for every decision (see sim/mesh.py)."""
