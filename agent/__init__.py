"""nftpolicy agent: every side effect (Kubernetes API, libnftables, network namespaces, HTTP)."""
