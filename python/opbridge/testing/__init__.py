"""Test helpers of opbridge (test doubles of vendor runtimes)."""
