"""The Neuron backends: `neuron-nxdi` (NxD Inference, `nxdi.py`) and `neuron-tnx` (transformers-neuronx,
`tnx.py`), both `NeuronBackend`s (`backend.py`: loading, the prefill loop, decode over every slot), over
the shared pieces in `runtime.py` (import guards, the version stack, core placement) and `steps.py`
(library-independent step plumbing: sampling rows, padding to the compiled batch, mapping outputs back
to slots).

Nothing here imports a Neuron package at module import time: the libraries come from AWS's Neuron
repository and exist only on Neuron hosts, so each backend imports its library when it loads.
"""
