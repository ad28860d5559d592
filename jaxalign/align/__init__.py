"""Measure, localise and close the trainer-engine gap."""
