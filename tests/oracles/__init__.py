"""Test oracles: independent re-derivations the product is checked against, never imported by it."""
