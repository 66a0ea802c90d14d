"""ember.core.step_fns."""
