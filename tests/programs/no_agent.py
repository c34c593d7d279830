"""Runs no agent at all: a normal end with no answer."""

print("nothing to do here")
