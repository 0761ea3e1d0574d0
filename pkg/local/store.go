package local

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
)

// The state directory, shared by the machine's GPU users (its group):
//
//	state.lock      the node lock (group-writable)
//	state.json      the machine's settings (policy, drained GPUs), which any
//	                member may change; before per-user files, also every
//	                allocation and waiter (legacy entries: still read, moved
//	                to their user's file by that user's next command)
//	uid-<uid>/      one user's directory, 0755, owned by that user
//	  state.json    that user's allocations and waiters, 0644, theirs
//
// A user can change only their own allocations: the group may create,
// and (without the sticky bit) rename entries of the state directory, but
// not write into another's directory, nor empty it to remove it, nor move
// it elsewhere (that rewrites its ".."). A user's entries are found by
// owner, not by name: every directory whose state.json belongs to the
// directory's owner is read, so a renamed one still counts, and one that
// another user made under your name first is not yours. Every command
// reads every user's file under the lock, so no one is handed a GPU
// another user holds. A dead holder's entry in another user's file is
// left there and only ignored (its liveness is decided on every read);
// its owner's next command removes it.

// userDirPrefix begins the name of the directory a user's first command
// makes: uid-<uid>.
const userDirPrefix = "uid-"

// fromLegacy marks an entry read from state.json (Request.from).
const fromLegacy = "state.json"

// fromUID marks an entry read from the files of the user uid.
func fromUID(uid int) string { return "uid:" + strconv.Itoa(uid) }

// writable says whether this process may record a change of r: its own,
// new, or a legacy entry. Another user's is only read.
func writable(r Request) bool {
	return r.from == "" || r.from == fromLegacy || r.from == fromUID(os.Geteuid())
}

// loadState reads the state directory: the settings file (with its
// legacy entries) and every user's file. A missing or empty settings file
// is an empty state. A corrupt settings file, or this user's own corrupt
// file, is moved aside (<file>.corrupt-<time>) and the state read without
// it, with an error saying so, as the plugin treats its checkpoint: what
// it recorded is lost, but the machine is usable again. Another user's
// file that cannot be trusted or read is left alone and skipped: skipped
// says why.
func loadState(dir string, now time.Time) (s *State, skipped []error, err error) {
	s, err = readFile(filepath.Join(dir, stateFile), fromLegacy, now, true)
	var corrupt *CorruptStateError
	if err != nil && !errors.As(err, &corrupt) {
		return nil, nil, err
	}
	users, skipped := readUserFiles(dir, now)
	s.merge(users)
	if corrupt != nil {
		return s, skipped, corrupt
	}
	for _, e := range skipped {
		if errors.As(e, &corrupt) {
			return s, skipped, corrupt
		}
	}
	return s, skipped, nil
}

// ReadState reads gpudra local's state without its lock and without
// changing anything (gpudra top, the dashboard and the kubelet plugin
// only look: the holders gpudra local would clean up stay). Each file is
// replaced atomically, so a read sees whole files. nil, nil: gpudra local
// was never used here.
func ReadState(dir string) (*State, error) {
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	s, err := readFile(filepath.Join(dir, stateFile), fromLegacy, time.Time{}, false)
	if err != nil {
		return nil, err
	}
	users, skipped := readUserFiles(dir, time.Time{})
	s.merge(users)
	if len(skipped) > 0 {
		return s, fmt.Errorf("gpudra local's state %s: %w", dir, errors.Join(skipped...))
	}
	return s, nil
}

// readFile reads one state file, its entries marked as from. Missing or
// empty: an empty state. Unparsable: with aside, moved aside and an empty
// state with a CorruptStateError; else the error.
func readFile(path, from string, now time.Time, aside bool) (*State, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) || (err == nil && len(bytes.TrimSpace(b)) == 0) {
		return &State{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	var s State
	if err := json.Unmarshal(b, &s); err != nil {
		if !aside {
			return nil, fmt.Errorf("parse gpudra local's state %s: %w", path, err)
		}
		to := fmt.Sprintf("%s.corrupt-%s", path, now.UTC().Format("20060102T150405"))
		if rerr := os.Rename(path, to); rerr != nil {
			return nil, fmt.Errorf("state %s is corrupt (%v) and cannot be moved aside: %w", path, err, rerr)
		}
		return &State{}, &CorruptStateError{Path: path, Aside: to, Err: err}
	}
	for i := range s.Allocations {
		s.Allocations[i].from = from
	}
	for i := range s.Waiters {
		s.Waiters[i].from = from
	}
	return &s, nil
}

// readUserFiles reads every user's file: each directory's state.json that
// belongs to the directory's owner, in name order (a name found twice
// counts once).
func readUserFiles(dir string, now time.Time) (*State, []error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return &State{}, []error{fmt.Errorf("list %s: %w", dir, err)}
	}
	out := &State{}
	// An allocation and a waiter of one name are one request in the
	// middle of its grant (a MIG device being made): seen apart.
	seenA, seenW := map[string]bool{}, map[string]bool{}
	var skipped []error
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		uid, ok := dirOwner(filepath.Join(dir, e.Name()))
		if !ok {
			continue
		}
		path := filepath.Join(dir, e.Name(), stateFile)
		if err := ownedBy(path, uid); errors.Is(err, fs.ErrNotExist) {
			continue
		} else if err != nil {
			skipped = append(skipped, err)
			continue
		}
		// Only the owner moves its own corrupt file aside.
		s, err := readFile(path, fromUID(uid), now, !now.IsZero() && uid == os.Geteuid())
		if err != nil {
			skipped = append(skipped, err)
		}
		if s == nil {
			continue
		}
		for _, a := range s.Allocations {
			if !seenA[a.Name] {
				seenA[a.Name] = true
				out.Allocations = append(out.Allocations, a)
			}
		}
		for _, w := range s.Waiters {
			if !seenW[w.Name] {
				seenW[w.Name] = true
				out.Waiters = append(out.Waiters, w)
			}
		}
	}
	return out, skipped
}

// dirOwner is the owner of path, a directory and not a link.
func dirOwner(path string) (int, bool) {
	fi, err := os.Lstat(path)
	if err != nil || !fi.IsDir() {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	return int(st.Uid), ok
}

// ownedBy checks that path is a regular file (not a link) owned by uid.
func ownedBy(path string, uid int) error {
	fi, err := os.Lstat(path)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.Mode().IsRegular() || !ok {
		return fmt.Errorf("%s is not a plain file: not read", path)
	}
	if int(st.Uid) != uid {
		return fmt.Errorf("%s belongs to uid %d, not to uid %d who owns its directory: not read", path, st.Uid, uid)
	}
	return nil
}

// merge adds the users' entries; a legacy entry that its user's file also
// has (moved there, the settings file not yet rewritten) counts once.
func (s *State) merge(users *State) {
	allocated, waiting := map[string]bool{}, map[string]bool{}
	for _, a := range users.Allocations {
		allocated[a.Name] = true
	}
	for _, w := range users.Waiters {
		waiting[w.Name] = true
	}
	s.Allocations = slices.DeleteFunc(s.Allocations, func(a Allocation) bool { return allocated[a.Name] })
	s.Waiters = slices.DeleteFunc(s.Waiters, func(w Waiter) bool { return waiting[w.Name] })
	s.Allocations = append(s.Allocations, users.Allocations...)
	s.Waiters = append(s.Waiters, users.Waiters...)
}

// adoptLegacy moves the legacy entries of this process's user (by login
// name) to their own file: from the next save on, no other user can
// change them; it says whether it moved any.
func (s *State) adoptLegacy() (moved bool) {
	u, err := user.LookupId(strconv.Itoa(os.Geteuid()))
	if err != nil {
		return false
	}
	own := fromUID(os.Geteuid())
	for i := range s.Allocations {
		if s.Allocations[i].from == fromLegacy && s.Allocations[i].User == u.Username {
			s.Allocations[i].from, moved = own, true
		}
	}
	for i := range s.Waiters {
		if s.Waiters[i].from == fromLegacy && s.Waiters[i].User == u.Username {
			s.Waiters[i].from, moved = own, true
		}
	}
	return moved
}

// saveState writes what this process may write of s: its user's entries
// (and new ones) to its own file, the settings and the legacy entries to
// state.json; each only when its content changed. The own file first: a
// crash between the two leaves a moved entry in both, which merge counts
// once.
func saveState(dir string, s *State) error {
	ownEntries, legacy := &State{}, &State{Drained: s.Drained, Policy: s.Policy}
	for _, a := range s.Allocations {
		switch {
		case a.from == fromLegacy:
			legacy.Allocations = append(legacy.Allocations, a)
		case writable(a.Request):
			ownEntries.Allocations = append(ownEntries.Allocations, a)
		}
	}
	for _, w := range s.Waiters {
		switch {
		case w.from == fromLegacy:
			legacy.Waiters = append(legacy.Waiters, w)
		case writable(w.Request):
			ownEntries.Waiters = append(ownEntries.Waiters, w)
		}
	}
	own := ownFile(dir)
	if own == "" {
		var err error
		if own, err = makeOwnDir(dir); err != nil {
			return err
		}
	}
	// Readable by all, writable by its user only.
	if err := writeIfChanged(own, ownEntries, 0o644); err != nil {
		return err
	}
	// Readable and writable by the directory's group: the machine's GPU
	// users, each as themselves.
	return writeIfChanged(filepath.Join(dir, stateFile), legacy, 0o664)
}

// ownFile is this user's file in dir: the first directory (by name) that
// this user owns with a state.json of theirs in it; "" when none.
func ownFile(dir string) string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return ""
	}
	me := os.Geteuid()
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		if uid, ok := dirOwner(path); ok && uid == me && ownedBy(filepath.Join(path, stateFile), me) == nil {
			return filepath.Join(path, stateFile)
		}
	}
	return ""
}

// makeOwnDir makes this user's directory, uid-<uid> (0755), or, where
// another user took that name first, a directory of a name beginning so.
func makeOwnDir(dir string) (string, error) {
	path := filepath.Join(dir, userDirPrefix+strconv.Itoa(os.Geteuid()))
	err := os.Mkdir(path, 0o755)
	if errors.Is(err, fs.ErrExist) {
		if uid, ok := dirOwner(path); !ok || uid != os.Geteuid() {
			path, err = os.MkdirTemp(dir, filepath.Base(path)+"-")
			if err == nil {
				err = os.Chmod(path, 0o755)
			}
		} else {
			err = nil
		}
	}
	if err != nil {
		return "", fmt.Errorf("your directory in gpudra local's state: %w", err)
	}
	return filepath.Join(path, stateFile), nil
}

func writeIfChanged(path string, s *State, mode os.FileMode) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, b) {
		return nil
	}
	return checkpoint.WriteFileAtomicMode(path, b, mode)
}
