"""Building, loading, wrapping and exporting models."""
