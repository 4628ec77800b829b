"""Programs that run on the deployment hosts (stdlib + what their venv holds)."""
