"""ember.models."""
