package controlplane

import (
	"fmt"
	"os"
	"sync"

	"k8s.io/klog/v2"
)

// ProcessTB lets the API server's test harness run outside `go test` (the
// demo binary). It logs through klog, turns fatal calls into a panic that
// devcluster.Start recovers, and runs cleanups in reverse order at Stop.
type ProcessTB struct {
	name string

	mu       sync.Mutex
	cleanups []func()
	failed   bool
	tempDirs []string
}

// NewProcessTB is a ProcessTB named name (its Name).
func NewProcessTB(name string) *ProcessTB { return &ProcessTB{name: name} }

// FatalError is what ProcessTB panics with on Fatal; devcluster.Start turns it back
// into an error.
type FatalError struct{ Msg string }

func (t *ProcessTB) Attr(string, string)       {}
func (t *ProcessTB) Chdir(string)              { panic(FatalError{Msg: "Chdir is not supported outside tests"}) }
func (t *ProcessTB) Error(args ...any)         { t.Log(args...); t.Fail() }
func (t *ProcessTB) Errorf(f string, a ...any) { t.Logf(f, a...); t.Fail() }
func (t *ProcessTB) Fail()                     { t.mu.Lock(); t.failed = true; t.mu.Unlock() }
func (t *ProcessTB) FailNow()                  { t.Fail(); panic(FatalError{Msg: "FailNow"}) }
func (t *ProcessTB) Failed() bool              { t.mu.Lock(); defer t.mu.Unlock(); return t.failed }
func (t *ProcessTB) Fatal(args ...any)         { t.Fail(); panic(FatalError{Msg: fmt.Sprint(args...)}) }
func (t *ProcessTB) Fatalf(f string, a ...any) {
	t.Fail()
	panic(FatalError{Msg: fmt.Sprintf(f, a...)})
}
func (t *ProcessTB) Helper()                 {}
func (t *ProcessTB) Log(args ...any)         { klog.V(4).InfoDepth(1, fmt.Sprint(args...)) }
func (t *ProcessTB) Logf(f string, a ...any) { klog.V(4).InfoDepth(1, fmt.Sprintf(f, a...)) }
func (t *ProcessTB) Name() string            { return t.name }
func (t *ProcessTB) Setenv(k, v string)      { _ = os.Setenv(k, v) }
func (t *ProcessTB) Skip(args ...any)        { panic(FatalError{Msg: "Skip: " + fmt.Sprint(args...)}) }
func (t *ProcessTB) Skipf(f string, a ...any) {
	panic(FatalError{Msg: "Skip: " + fmt.Sprintf(f, a...)})
}
func (t *ProcessTB) SkipNow()      { panic(FatalError{Msg: "SkipNow"}) }
func (t *ProcessTB) Skipped() bool { return false }

func (t *ProcessTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}

func (t *ProcessTB) TempDir() string {
	dir, err := os.MkdirTemp("", "devcluster-")
	if err != nil {
		t.Fatalf("TempDir: %v", err)
	}
	t.mu.Lock()
	t.tempDirs = append(t.tempDirs, dir)
	t.mu.Unlock()
	return dir
}

// RunCleanups runs the registered cleanups, last first, as testing does.
func (t *ProcessTB) RunCleanups() {
	t.mu.Lock()
	cleanups, dirs := t.cleanups, t.tempDirs
	t.cleanups, t.tempDirs = nil, nil
	t.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
	for _, d := range dirs {
		_ = os.RemoveAll(d)
	}
}
