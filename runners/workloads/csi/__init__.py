"""The CSI v1 messages and services the node cache agent answers (csi.proto), and their generated Python."""
