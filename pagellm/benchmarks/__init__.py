"""Benchmarks that ship with the package (`pagellm bench ...`)."""
