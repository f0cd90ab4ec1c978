"""Cost models and hardware profiles (and, later, configurators that use them)."""
