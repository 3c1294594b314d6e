"""The node agent (``nftpolicy agent``): sources, the reconcile loop, health, metrics. It never imports the test bed or the command line."""
