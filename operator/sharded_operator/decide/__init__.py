"""Pure decisions: a job's lifecycle, failure attribution, progress intake rules, and the views they decide on."""
