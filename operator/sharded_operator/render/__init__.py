"""Pure renderers of a job's children: the Service, ConfigMap, claim and pods, and one module per
scheduler integration."""
