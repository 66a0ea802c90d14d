"""ember.core.partition_specs."""
