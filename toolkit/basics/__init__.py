"""The ground floor: atomic files, path rules, exit codes, the conf folder and the known
warnings. Every other package may import it; it imports nothing of gridwright and no heavy
package."""
