"""Code that runs inside the vLLM inference server, loaded through vLLM's plugin entry point
(``vllm.general_plugins``): it imports no more of the project than the transfer's wire format
(``app/services/transfer_wire.py``), which the trainer writes to."""
