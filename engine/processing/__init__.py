"""processing"""
