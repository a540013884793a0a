"""method"""
