package plugin

import (
	"context"
	"errors"
	"fmt"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/prepared"
)

// sweep cleans up after a kill, under the node lock so that it never races
// a prepare of another plugin instance: it rolls back interrupted prepares,
// removes CDI specs no record names (a kill between writing a spec and
// recording the claim) and resumes the sharing of prepared claims. What
// fails is logged and kept for RetryInterrupted.
func (s *NodeState) sweep(ctx context.Context) error {
	return s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		_, err := s.rollbackInterruptedLocked(ctx, cp)
		errs := []error{err}
		// A kill between staging a checkpoint and its rename leaves the
		// staged file; nothing else stores now (the node lock is held).
		if err := checkpoint.RemoveStale(s.opts.CheckpointPath); err != nil {
			errs = append(errs, fmt.Errorf("remove temporary checkpoint files: %w", err))
		}
		uids, err := s.opts.CDI.ClaimUIDs()
		if err != nil {
			errs = append(errs, err)
		}
		for _, uid := range uids {
			if _, known := cp.Claims[uid]; known {
				continue
			}
			klog.FromContext(ctx).Info("Removing a CDI spec left by an interrupted prepare", "uid", uid)
			errs = append(errs, s.opts.CDI.Remove(uid))
		}
		// The device index is built now, not by the first prepare (0.2 to
		// 0.8 ms of it for a DGX H100's 208 devices); a failed read leaves
		// that to the first prepare, which reads the GPUs anyway.
		if inv, err := nvdevice.ReadOnlyInventory(ctx, s.opts.Backend); err == nil {
			s.indexLocked(inv)
		}
		if s.opts.Sharing != nil {
			var claims []prepared.Claim
			for uid := range cp.Claims {
				c, _ := cp.Claim(uid)
				claims = append(claims, c)
			}
			if err := s.opts.Sharing.Resume(ctx, claims); err != nil {
				errs = append(errs, fmt.Errorf("resume the sharing of prepared claims: %w", err))
			}
		}
		return errors.Join(errs...)
	})
}

// RetryInterrupted rolls back the prepares that a kill interrupted and whose
// rollback failed before (a GPU that was lost, say). It is cheap when there
// is none; the plugin calls it periodically (Driver.retryInterrupted). It
// reports whether a rollback destroyed MIG devices the driver had made.
func (s *NodeState) RetryInterrupted(ctx context.Context) bool {
	destroyedMig := false
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		var err error
		destroyedMig, err = s.rollbackInterruptedLocked(ctx, cp)
		return err
	})
	if err != nil {
		klog.FromContext(ctx).Error(err, "Rolling back interrupted prepares failed; kept and retried later")
	}
	return destroyedMig
}

// SuperviseSharing starts again what prepared claims need and is gone (an
// MPS server), from the checkpoint and under the node lock: a server that
// another plugin instance stopped at an unprepare is not brought back.
func (s *NodeState) SuperviseSharing(ctx context.Context) {
	if s.opts.Sharing == nil {
		return
	}
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		var claims []prepared.Claim
		for uid, c := range cp.Claims {
			if c.State == prepared.PrepareStarted {
				continue // being rolled back, not served
			}
			claim, _ := cp.Claim(uid)
			claims = append(claims, claim)
		}
		return s.opts.Sharing.Supervise(ctx, claims)
	})
	if err != nil {
		klog.FromContext(ctx).Error(err, "Supervising the sharing of prepared claims failed; retried later")
	}
}

// Interrupted lists the claims whose prepare was interrupted and not yet
// rolled back.
func (s *NodeState) Interrupted(ctx context.Context) ([]string, error) {
	var out []string
	err := s.withLock(ctx, func(cp *checkpoint.Checkpoint) error {
		for uid, c := range cp.Claims {
			if c.State == prepared.PrepareStarted {
				out = append(out, uid)
			}
		}
		return nil
	})
	return out, err
}

// rollbackInterruptedLocked rolls back every record of an interrupted
// prepare, and reports whether one that it rolled back had made MIG
// devices. Under the node lock such a record is never one in progress: a
// prepare holds the lock from its intent to its completion.
func (s *NodeState) rollbackInterruptedLocked(ctx context.Context, cp *checkpoint.Checkpoint) (bool, error) {
	var errs []error
	destroyedMig := false
	for uid, c := range cp.Claims {
		if c.State != prepared.PrepareStarted {
			continue
		}
		klog.FromContext(ctx).Info("Rolling back a prepare interrupted by a restart", "claim", klog.KRef(c.Namespace, c.Name), "uid", uid)
		if err := s.rollbackLocked(ctx, cp, uid); err != nil {
			errs = append(errs, fmt.Errorf("claim %s/%s (%s): %w", c.Namespace, c.Name, uid, err))
			continue
		}
		destroyedMig = destroyedMig || c.CreatesMig()
	}
	return destroyedMig, errors.Join(errs...)
}
