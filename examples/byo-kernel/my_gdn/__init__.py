"""my_gdn: an example third-party GDN kernel package with a gdn-parity backend (my_gdn.parity_backend)."""
