"""moepager"""
