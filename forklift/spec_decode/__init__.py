"""Speculative decoding: cheap proposers guess the next tokens, and the target model checks
them all in one step (docs/architecture.md, "Speculative decoding")."""
