"""The file organizer: plan, apply, move, undo and redo in configured inboxes; never deletes, never overwrites."""

from bastion.organizer.inbox import Organizer, journal_path
from bastion.organizer.journal import Action, History, Move
from bastion.organizer.rules import Rules

__all__ = ["Action", "History", "Move", "Organizer", "Rules", "journal_path"]
