"""ember.data."""
