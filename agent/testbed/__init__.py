"""The test bed: network-namespace sandboxes, probes, a real control plane and real nodes, twin-sandbox comparison. Only the command line and the tests import it."""
