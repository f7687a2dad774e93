"""modelfleet: serve Mixture-of-Experts language models across fleets of small machines.

The Python code lives in three layers, imported under this one namespace:
``modelfleet.engine`` (model math), ``modelfleet.agent`` (processes, wire, HTTP) and
``modelfleet.operator`` (Kubernetes). Imports point downward only.
"""

__version__ = "0.1.0"
