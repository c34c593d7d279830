"""Sandbox backends."""
