"""The OpenVINO stage backend (seed 000's resident MoE engine): :mod:`.stage` is the backend,
:mod:`.graphs` the compiled graphs, :mod:`.export` turns the engine's weights into expert banks,
:mod:`.fusion` asserts OpenVINO fused them, :mod:`.ranges` is Eq. 1, :mod:`.runtime` runs them."""
