"""Lua transition scripts, one file each, shipped as package data."""
