"""Transport security and client identity: TLS/mTLS credentials and channels (tls), bearer
tokens and per-client identity (auth)."""
