"""User models written the way people write them, for capture tests (fixtures, not ptc code)."""
