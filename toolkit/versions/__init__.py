"""The tested releases of the libraries gridwright reaches inside, and what happens with another."""
