"""nftpolicy translators: pure code from Kubernetes manifests to a rule model and to nft text."""
