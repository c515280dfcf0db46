"""The aenv benchmark harness: `aenv bench` (or `make bench`); see bench/README.md."""
