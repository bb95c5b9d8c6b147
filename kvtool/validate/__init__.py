"""`kvtool validate`: a conformance kit that drives a connector through the protocol's hard cases.

The bundled runtime is the fixed point; the connector is under test. Each scenario runs in its own
process, with a timeout, in a fresh working directory, and reports named checks.
"""
