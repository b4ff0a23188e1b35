"""epdmesh: disaggregated encode / prefill / decode serving for multimodal LLMs."""

__version__ = "0.1.0"
