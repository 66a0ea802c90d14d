"""ember.optim."""
